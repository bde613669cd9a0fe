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


class CharTransformer(nn.Module):
    """Embedding + learned positions -> pre-norm causal transformer layers -> linear over bytes: (B, T) -> (B, T, VOCAB).

    Each layer is a dozen tensors (attention, feed-forward, two norms), many
    of one shape: the kind of model whose exchanges pay per tensor, not per
    byte (``transformer()``).
    """

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)  # (context, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T) bytes -> (B, T, VOCAB) logits; a pipeline stage (``stage``) takes or gives (B, T, width) instead."""
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)  # (T, T): no peeking ahead
        h = x if self.embed is None else self.embed(x) + self.position[:t]  # (B, T, width)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)  # (B, T, width)
        return h if self.head is None else self.head(self.norm(h))  # (B, T, VOCAB), or (B, T, width) mid-pipeline

    def stage(self, index: int, stages: int) -> "CharTransformer":
        """Cut this model, in place, to pipeline stage ``index`` of ``stages``: its share of the layers (the first
        stage also the embeddings, the last the final norm and head); the others' parameters are dropped, and the
        names of those kept are the unsplit model's (``layers.5.linear1.weight``), so the stages' pieces gather
        back into the unsplit state_dict. For ``torch.distributed.pipelining.PipelineStage``."""
        if not 0 <= index < stages <= len(self.layers):
            raise ValueError(f"stage {index} of {stages}: a model of {len(self.layers)} layers has 1..{len(self.layers)} stages")
        mine = range(*[len(self.layers) * k // stages for k in (index, index + 1)])
        for i in range(len(self.layers)):
            if i not in mine:
                self.layers[i] = _Skip()
        if index > 0:
            self.embed = None
            self.position = None
        if index < stages - 1:
            self.norm = None
            self.head = None
        return self


class _Skip(nn.Module):
    """A layer another pipeline stage holds: passes its input on (no parameters, so the names of the rest stay)."""

    def forward(self, h: Tensor, **_: object) -> Tensor:
        return h


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
    """Next-byte prediction on standard-library source with a GRU (about 120k parameters at the defaults).

    ``layers`` > 0 makes the model a causal transformer instead
    (``CharTransformer``: width ``embed``, ``layers`` layers of ``heads``
    heads; ``hidden`` is then unused).
    """

    name = "charlm"
    _text: ClassVar[dict[int, Tensor]] = {}  # read once per process, per length

    def __init__(
        self, context: int = 64, embed: int = 48, hidden: int = 128, text_bytes: int = TEXT_BYTES,
        layers: int = 0, heads: int = 4,
    ) -> None:
        if context < 2 or embed < 1 or hidden < 1:
            raise WorkloadError(f"charlm: context must be >= 2 and sizes >= 1, got {context}, {embed}, {hidden}")
        if layers < 0 or (layers and (heads < 1 or embed % heads)):
            raise WorkloadError(f"charlm: layers must be >= 0 and embed ({embed}) a multiple of heads ({heads}), got {layers}, {heads}")
        self.context, self.embed, self.hidden, self.layers, self.heads = context, embed, hidden, layers, heads
        if text_bytes not in self._text:
            self._text[text_bytes] = torch.frombuffer(bytearray(read_text(text_bytes)), dtype=torch.uint8).to(torch.int64)
        data = self._text[text_bytes]  # (L,)
        cut = int(len(data) * (1 - VALIDATION_FRACTION))
        self._train, self._valid = data[:cut], data[cut:]  # (L_train,), (L_valid,)

    def build_model(self, seed: int) -> nn.Module:
        """The model, initialised from ``seed`` without disturbing the global RNG (peers share a process in the simulator)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.layers:
                return CharTransformer(self.embed, self.layers, self.heads, self.context)
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


#: ``transformer()``'s sizes: as many parameters as ``large()``, in many more tensors.
TRANSFORMER_WIDTH, TRANSFORMER_LAYERS, TRANSFORMER_HEADS = 192, 9, 3


def transformer() -> CharLMWorkload:
    """``peers.charlm:transformer``: 9 pre-norm layers of width 192, 4,115,008 parameters in 114 tensors (16 MB).

    About the bytes of ``large()`` (7 tensors) in 16 times as many tensors,
    nine of most shapes, as in any transformer: experiments/exchange.py ``--model
    charlm-transformer`` shows what an exchange costs per tensor.
    """
    return CharLMWorkload(embed=TRANSFORMER_WIDTH, layers=TRANSFORMER_LAYERS, heads=TRANSFORMER_HEADS)


def _windows(text: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of ``text`` (L,): inputs (N, context) and the same shifted by one (N, context)."""
    n = (len(text) - 1) // context
    if n < 1:
        raise WorkloadError(f"charlm: a shard of {len(text)} bytes is shorter than one window of {context + 1}")
    x = text[: n * context].reshape(n, context)
    y = text[1 : n * context + 1].reshape(n, context)
    return x, y
