"""The shared types at the bottom of the library: every package may import them, they import nothing of mint.

Kept free of torch and transformers, so a command that only reads the registry stays fast.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import core_schema

# Parameters of fused MoE expert modules (transformers 5 stores all experts of a layer as one 3D tensor,
# [experts, out, in], applied with F.linear(x, W[e])).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


# ---- the device switch ------------------------------------------------------------------------------------

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def parse_device(text: str) -> str:
    """`text` if it names a device mint runs a base on (cpu, cuda, cuda:N); ValueError naming it otherwise. Whether
    a CUDA device is visible is `mint_core.engine.device.check_device`'s to say (it needs torch)."""
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"{text}: not a device; expected cpu, cuda or cuda:N")
    return text


Device = Annotated[str, AfterValidator(parse_device)]
"""A settings field naming the device of the base, the engine and the trainer: cpu, cuda (the current CUDA
device) or cuda:N."""


@dataclass(frozen=True)
class Site:
    """One place a LoRA can attach: a linear layer, or one 3D expert parameter (`experts` > 0)."""

    name: str  # module path for a linear ("model.layers.0.self_attn.q_proj"), module path + "." + param for experts
    in_features: int
    out_features: int
    experts: int = 0  # 0 for a plain linear

    @property
    def module_path(self) -> str:
        return self.name.rpartition(".")[0] if self.experts else self.name

    @property
    def short(self) -> str:
        """The name PEFT matches in `target_modules` (linear) or `target_parameters` suffix (experts)."""
        return self.name.rpartition(".")[2]


# ---- revision digests --------------------------------------------------------------------------------------

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
"""The two files of a revision in PEFT's layout; a revision's digest covers both."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_PREFIX = "sha256:"


class DigestError(ValueError):
    """Text that is not a revision digest; names the text."""


class Digest(str):
    """A revision's identity: the sha256 of its two files (`Digest.of_files`).

    Parsed once where it enters (`Digest.parse` takes 64 lowercase hex digits, bare or as `sha256:<hex>`) and passed as
    this type afterwards. The string value is the 64 lowercase hex digits, so a digest is its own key in the
    catalog's tables, MLflow's `mint.digest` tag and the store's paths; `.prefixed` (`sha256:<hex>`) is how it
    is written as an address, and `repr` shows that form.
    """

    __slots__ = ()

    def __new__(cls, text: object) -> Digest:
        if isinstance(text, Digest):
            return text
        if not isinstance(text, str):
            raise DigestError(f"malformed revision digest {text!r}: expected a string of 64 hex digits")
        hex_ = text[len(_PREFIX) :] if text.startswith(_PREFIX) else text
        if not _HEX64.fullmatch(hex_):
            raise DigestError(
                f"malformed revision digest {text!r}: not 64 lowercase hex digits (a sha256), bare or "
                "`sha256:`-prefixed"
            )
        return str.__new__(cls, hex_)

    @classmethod
    def parse(cls, text: object) -> Digest:
        """The digest `text` names (64 lowercase hex, bare or `sha256:<hex>`); `DigestError` naming the text otherwise."""
        return cls(text)

    @classmethod
    def trusted(cls, hex_: str) -> Digest:
        """A digest from a source that only ever holds well-formed ones (the catalog's own rows), unchecked."""
        return str.__new__(cls, hex_)

    @classmethod
    def of_files(cls, config_bytes: bytes, weights_bytes: bytes | bytearray | memoryview) -> Digest:
        """The digest of a revision's two files: both files' names and bytes in a fixed order."""
        h = cls.hasher(config_bytes, len(weights_bytes))
        h.update(weights_bytes)
        return cls.trusted(h.hexdigest())

    @staticmethod
    def hasher(config_bytes: bytes, weights_size: int) -> hashlib._Hash:
        """A sha256 fed with everything of `of_files` but the weights file's bytes: feed those (in pieces, as
        they are read) and `Digest.trusted(h.hexdigest())` is the revision's digest, with no second pass."""
        h = hashlib.sha256()
        h.update(CONFIG_FILE.encode() + b"\0" + len(config_bytes).to_bytes(8, "little"))
        h.update(config_bytes)
        h.update(WEIGHTS_FILE.encode() + b"\0" + weights_size.to_bytes(8, "little"))
        return h

    @property
    def hex(self) -> str:
        """The 64 lowercase hex digits as a plain `str`."""
        return str.__str__(self)

    @property
    def prefixed(self) -> str:
        """`sha256:<hex>`: the digest as an address."""
        return _PREFIX + self

    @property
    def short(self) -> str:
        """The first 12 hex digits, for logs and tables."""
        return self[:12]

    def __repr__(self) -> str:
        return f"Digest({self.prefixed!r})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # a pydantic field of this type parses bare or prefixed text and serialises the bare hex
        return core_schema.no_info_after_validator_function(
            cls.parse, core_schema.str_schema(), serialization=core_schema.to_string_ser_schema()
        )
