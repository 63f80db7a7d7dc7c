"""Bytes per parameter of each model state (AdamW) in a training precision, as the programs hold them."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per parameter of each model state (AdamW), as the programs hold them.

    `grad_bytes` is a ZeRO-0 gradient: held and all-reduced in `grad_reduce`'s format (mixed precision:
    fp32 by default, the compute format when pinned). Gradients of parameters sharded over the data axis
    (ZeRO >= 1) are reduce-scattered in the compute format, the transpose of their compute-format gathers
    (`grad_bytes_at`).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    grad_reduce: str = "fp32"

    @classmethod
    def get(cls, name: str, grad_reduce: str | None = None) -> Precision:
        reduce = grad_reduce or "fp32"
        if name in ("bf16", "fp16"):
            if reduce not in ("fp32", name):
                raise ConfigError(
                    f"grad_reduce={reduce!r} with precision {name!r}: gradients are reduced in 'fp32' "
                    f"(the default) or in the compute format {name!r}"
                )
            # compute-format weights, fp32 master weights and two fp32 moments (ZeRO paper: 2 + 2 + 12), and
            # gradients in the format they are reduced in
            return cls(name, 2, 4 if reduce == "fp32" else 2, 12, reduce)
        if name == "fp32":
            if reduce != "fp32":
                raise ConfigError(f"grad_reduce={reduce!r} with precision 'fp32': fp32 training reduces in 'fp32'")
            return cls(name, 4, 4, 8, reduce)
        raise ConfigError(f"unknown precision {name!r}: expected 'bf16', 'fp16' or 'fp32'")

    def grad_bytes_at(self, stage: int) -> int:
        """Bytes of one gradient element as held and reduced at ZeRO stage `stage`."""
        return self.grad_bytes if stage == 0 else self.param_bytes
