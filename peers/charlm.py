"""The charlm workload: a character-level language model on text that ships with Python.

A workload that is not a toy classifier: a GRU predicts the next byte of
source code, trained with Adam (``--optimizer adam --lr 0.003``), scored by
validation loss and bits per character. The text is the standard library's
own source (``TEXT_MODULES``, read from this interpreter's installation:
nothing is downloaded), the first ``TEXT_BYTES`` bytes of their
concatenation; peers on the same Python version read the same text. Shards
are contiguous slices of the training text, in order: "each peer's data is
different" as it is for text, where a peer holds its own documents.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gossiptrain.train.evaluation import EvalResult, classification_eval
from gossiptrain.train.workload import WorkloadError

__all__ = ["CharLMWorkload", "TextEvalResult"]

#: Standard-library modules whose source is the text, in this order (each exists on every CPython 3).
TEXT_MODULES = ("textwrap", "difflib", "argparse", "shlex", "fractions", "calendar", "csv", "string")
TEXT_BYTES = 250_000  # of their concatenation (about 300 KB on CPython 3.11)
VOCAB = 256  # bytes
VALIDATION_FRACTION = 0.1  # the end of the text; training is the rest
VALIDATION_WINDOWS = 64  # evaluated windows (spread over the validation text): a fixed, quick evaluation


@dataclass(frozen=True)
class TextEvalResult(EvalResult):
    """EvalResult plus bits per character (the loss in bits rather than nats)."""

    bits_per_char: float = math.nan


class CharGRU(nn.Module):
    """Embedding -> GRU -> linear over bytes: (B, T) int64 -> (B, T, VOCAB) logits."""

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.gru(self.embed(x))  # (B, T, hidden)
        return self.head(h)  # (B, T, VOCAB)


def read_text(limit: int = TEXT_BYTES) -> bytes:
    """The first ``limit`` bytes of the ``TEXT_MODULES`` sources, concatenated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in TEXT_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            raise WorkloadError(f"charlm: the standard library's {path} is missing; the text is built from {TEXT_MODULES}")
        chunks.append(path.read_bytes())
    text = b"\n".join(chunks)[:limit]
    if len(text) < limit:
        raise WorkloadError(f"charlm: the sources hold {len(text)} bytes, fewer than the {limit} asked for")
    return text


class CharLMWorkload:
    """Next-byte prediction on standard-library source with a GRU (about 120k parameters at the defaults)."""

    name = "charlm"
    _text: ClassVar[dict[int, Tensor]] = {}  # read once per process, per length

    def __init__(self, context: int = 64, embed: int = 48, hidden: int = 128, text_bytes: int = TEXT_BYTES) -> None:
        if context < 2 or embed < 1 or hidden < 1:
            raise WorkloadError(f"charlm: context must be >= 2 and sizes >= 1, got {context}, {embed}, {hidden}")
        self.context, self.embed, self.hidden = context, embed, hidden
        if text_bytes not in self._text:
            self._text[text_bytes] = torch.frombuffer(bytearray(read_text(text_bytes)), dtype=torch.uint8).to(torch.int64)
        data = self._text[text_bytes]  # (L,)
        cut = int(len(data) * (1 - VALIDATION_FRACTION))
        self._train, self._valid = data[:cut], data[cut:]  # (L_train,), (L_valid,)

    def build_model(self, seed: int) -> nn.Module:
        """The GRU, initialised from ``seed`` without disturbing the global RNG (peers share a process in the simulator)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CharGRU(self.embed, self.hidden)

    def train_shard(self, index: int, count: int, seed: int) -> tuple[Tensor, Tensor]:
        """Windows (N, context) of shard ``index``: a contiguous slice of the training text, and next bytes (N, context).

        ``seed`` does not move the slices: shard i is always the i-th part of the text.
        """
        if not 0 <= index < count:
            raise WorkloadError(f"charlm: shard {index} is not in [0, {count})")
        part = torch.tensor_split(self._train, count)[index]  # (n,)
        return _windows(part, self.context)

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        logits = model(inputs)  # (B, T, VOCAB)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def evaluate(self, model: nn.Module) -> TextEvalResult:
        """Loss (nats per byte), bits per character and next-byte accuracy on windows spread over the validation text."""
        inputs, targets = _windows(self._valid, self.context)
        pick = torch.linspace(0, len(inputs) - 1, min(VALIDATION_WINDOWS, len(inputs))).long()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(inputs[pick]).reshape(-1, VOCAB)  # (W * T, VOCAB)
        finally:
            model.train(was_training)
        base = classification_eval(logits, targets[pick].reshape(-1), VOCAB)
        return TextEvalResult(**base.to_dict(), bits_per_char=base.loss / math.log(2))


#: ``large()``'s sizes: a GRU of a few million parameters.
LARGE_EMBED, LARGE_HIDDEN = 256, 1024


def large() -> CharLMWorkload:
    """``peers.charlm:large``: embed 256, hidden 1024, 4,266,240 parameters (17 MB in float32).

    A model whose exchange is not free: experiments/exchange.py ``--model
    charlm-large`` measures exchange throughput on it against raw ZeroMQ and
    its step time against its exchange time; experiments/gpu_check.py runs two
    peers of it on CUDA.
    """
    return CharLMWorkload(embed=LARGE_EMBED, hidden=LARGE_HIDDEN)


def _windows(text: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of ``text`` (L,): inputs (N, context) and the same shifted by one (N, context)."""
    n = (len(text) - 1) // context
    if n < 1:
        raise WorkloadError(f"charlm: a shard of {len(text)} bytes is shorter than one window of {context + 1}")
    x = text[: n * context].reshape(n, context)
    y = text[1 : n * context + 1].reshape(n, context)
    return x, y
