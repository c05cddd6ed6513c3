"""Build a tiny, deterministic Llama-architecture model for tests, entirely offline.

Why: the connector and control-plane tests need a *real* vLLM engine serving a real
model, but this project runs on machines without hub access or a GPU. A 2-layer Llama
with hidden size 256 loads in a second, makes KV caches that are cheap to move and
compare, and exercises exactly the same vLLM code paths (Llama attention, paged KV
cache, tokenizer, chat template) as a production model.

Everything is seeded: the same arguments produce byte-identical weights and an
identical tokenizer, so greedy outputs recorded by one test run stay valid for the next.

Float32 is the default because, with random weights, bfloat16 makes greedy outputs
depend on how requests happen to be batched (measured: 4 of 90 outputs differed under
overload), and the "disaggregated output == single-engine output" tests need exact
equality.

Usage::

    python -m kvbaton.tinymodel OUT_DIR [--dtype float32|bfloat16] [--seed 0] [--force]

or from Python: ``ensure_tiny_model(path)`` (idempotent, safe under concurrent callers).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SHAPES", "TinyModelSpec", "ensure_tiny_model", "build_tiny_model", "main", "spec_for_shape"]

#: Written last; its presence (with matching content) means the directory is complete.
STAMP_NAME = "kvbaton_tinymodel.json"
#: Bump when the generator changes in a way that changes the produced files.
GENERATOR_VERSION = 1

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

#: A minimal Llama-style template. The BOS is emitted by the template (vLLM tokenizes
#: chat prompts with add_special_tokens=False), each turn ends with EOS so a model that
#: learned it would stop there; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the generated files (recorded in the stamp)."""

    dtype: str = "float32"
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    #: GQA (2 KV heads < 4 query heads) so KV geometry code sees num_kv_heads != num_heads.
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    #: Larger than HF's usual 0.02 so attention is not nearly uniform: the generated text
    #: then depends clearly on the KV cache contents, which is what transfer tests check.
    initializer_range: float = 0.08
    tie_word_embeddings: bool = True
    corpus_sentences: int = 20000
    generator_version: int = GENERATOR_VERSION

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")



#: Named model shapes. ``tiny`` is what every test uses. ``compute`` keeps the KV cache's
#: size per token (4 layers x K,V x 1 KV head x 64 x 4 bytes = 2,048 bytes, as ``tiny``'s
#: 2 x 2 x 2 x 64 x 4) but costs ~13x the prefill arithmetic per token (hidden 512, MLP
#: 2,048): ~30 MFLOP per token against ~2.4, i.e. ~15k FLOP per byte of KV instead of ~1.2k
#: (a Qwen3-32B-class model: ~240k). Why it exists: with ``tiny`` a prefill of 6k tokens
#: costs about as much as the queueing noise on a 2-core machine, so a benchmark of
#: *avoiding* recompute (reuse) measures noise; ``compute`` makes recompute cost more of
#: what it costs in a real model (still ~16x less per byte of KV moved).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "compute": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 1},
}


def spec_for_shape(shape: str, **overrides: object) -> TinyModelSpec:
    """The spec of a named shape (``SHAPES``), with any field overridden."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    return TinyModelSpec(**{**SHAPES[shape], **overrides})  # type: ignore[arg-type]

# --------------------------------------------------------------------------- corpus

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
           "w", "st", "tr", "pl", "ch", "sh", "th", "gr", "br"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng"]
_COMMON = ("the of and to in is that it was for on are as with his they at be this from "
           "have or by one had not but what all were when we there can an your which their "
           "said if do will each about how up out them then she many some so these would "
           "other into has more her two like him see time could no make than first been "
           "its who now people my made over did down only way find use may water long "
           "little very after words called just where most know cache block prefill decode "
           "token engine transfer memory request lease model layer batch").split()
_PUNCT = [".", ".", ".", "!", "?", ","]


def _corpus(seed: int, n_sentences: int) -> Iterator[str]:
    """Yield a deterministic English-like corpus (Zipf-ish words, digits, punctuation).

    Why synthetic: no dataset is reachable offline, and the tokenizer only has to cover
    arbitrary text (byte-level BPE always can) with plausible merges.
    """
    rng = random.Random(seed)
    invented = sorted({
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        + (rng.choice(_VOWELS) + rng.choice(_CODAS) if rng.random() < 0.5 else "")
        for _ in range(3000)
    })
    vocab = _COMMON + invented
    weights = [1.0 / (i + 1) ** 0.9 for i in range(len(vocab))]
    for _ in range(n_sentences):
        n = rng.randint(4, 18)
        words = rng.choices(vocab, weights=weights, k=n)
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10000)))
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice(_PUNCT)


# ------------------------------------------------------------------------ tokenizer

def _train_tokenizer(spec: TinyModelSpec):  # -> transformers.PreTrainedTokenizerFast
    """Train a byte-level BPE tokenizer (Llama/GPT-2 style: any UTF-8 text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [BOS, EOS, UNK, PAD, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed, spec.corpus_sentences), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Completions are tokenized with add_special_tokens=True: prepend BOS like Llama does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------- model

def _build_model(spec: TinyModelSpec, tokenizer):  # -> transformers.LlamaForCausalLM
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Seed torch's global RNG (HF init uses it) but restore it so callers are unaffected.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        # HF init may skip weights or differ across versions; re-init explicitly so the
        # weights depend only on (seed, shapes) and not on transformers' init policy.
        gen = torch.Generator().manual_seed(spec.seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * spec.initializer_range)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype  # transformers 5 name (``torch_dtype`` is deprecated)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


# ------------------------------------------------------------------------- building

def _stamp_text(spec: TinyModelSpec) -> str:
    return json.dumps(asdict(spec), sort_keys=True, indent=1) + "\n"


def _is_complete(out_dir: Path, spec: TinyModelSpec) -> bool:
    stamp = out_dir / STAMP_NAME
    try:
        if stamp.read_text() != _stamp_text(spec):
            return False
    except OSError:
        return False
    return all((out_dir / f).is_file() for f in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))


@contextlib.contextmanager
def _build_lock(out_dir: Path, timeout_s: float = 600.0) -> Iterator[None]:
    """Serialize concurrent builders (e.g. pytest-xdist workers) of the same directory."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not lock {lock_path} within {timeout_s}s") from exc
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_tiny_model(out_dir: str | os.PathLike[str], spec: TinyModelSpec) -> Path:
    """Unconditionally build the model into ``out_dir`` (built aside, then moved in).

    The build happens in a sibling temp directory and the stamp is moved in last, so a
    crash never leaves a directory that ``ensure_tiny_model`` would accept.
    """
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        tokenizer = _train_tokenizer(spec)
        model = _build_model(spec, tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP_NAME).write_text(_stamp_text(spec))
        # mkdtemp makes 0700 and some writers 0600: engines may run as another user.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if not out.exists():
            os.rename(tmp, out)
        else:
            stale = out / STAMP_NAME
            stale.unlink(missing_ok=True)
            for f in sorted(tmp.iterdir(), key=lambda p: p.name == STAMP_NAME):
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_model(
    out_dir: str | os.PathLike[str],
    spec: TinyModelSpec | None = None,
    *,
    force: bool = False,
) -> Path:
    """Return ``out_dir`` holding the tiny model, building it only if needed.

    Idempotent: if the directory already holds a complete build with the same spec
    (checked via the stamp file), it returns at once without importing torch.
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir).resolve()
    if not force and _is_complete(out, spec):
        return out
    with _build_lock(out):
        if not force and _is_complete(out, spec):  # another process built it meanwhile
            return out
        return build_tiny_model(out, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbaton.tinymodel", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position-embeddings", type=int, default=TinyModelSpec.max_position_embeddings)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                   help="named model shape (tiny: the tests'; compute: same KV bytes per token, ~13x the prefill work)")
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = p.parse_args(argv)
    spec = spec_for_shape(args.shape, dtype=args.dtype, seed=args.seed,
                          max_position_embeddings=args.max_position_embeddings)
    t0 = time.monotonic()
    already = not args.force and _is_complete(Path(args.out_dir), spec)
    out = ensure_tiny_model(args.out_dir, spec, force=args.force)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    verb = "already present" if already else "built"
    print(f"{verb}: {out} ({size / 1e6:.1f} MB, {time.monotonic() - t0:.1f}s)", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
