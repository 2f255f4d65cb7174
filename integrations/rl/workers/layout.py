"""How a trainer group's ranks are laid out.

A group of ``dp x tp x pp`` ranks is laid out the way Megatron-Core orders its groups
(``order="tp-cp-ep-dp-pp"`` with CP = EP = 1): tensor-parallel rank fastest, then data-parallel, then
pipeline stage, so rank ``r`` is TP rank ``r % tp``, DP rank ``(r // tp) % dp`` and stage
``r // (tp * dp)``. With ``pp = 1`` that is the FSDP2 workers' ``("dp", "tp")`` device mesh. The
ranks of one DP rank (its TP x PP ranks) hold one replica; its leader (TP = PP = 0) writes back.

>>> layout = RankLayout(dp=2, tp=2, pp=2)
>>> layout.world, [layout.dp_rank(r) for r in range(8)]
(8, [0, 0, 1, 1, 0, 0, 1, 1])
>>> layout.leaders()
[0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataplane import InvalidArgument
from dataplane.checks import check_int

__all__ = ["RankLayout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    """A trainer group's ``dp x tp x pp`` layout (see the module docstring).

    Attributes:
        dp: data-parallel size (replicas of the model).
        tp: tensor-parallel size.
        pp: pipeline-parallel size (Megatron workers only).
    """

    dp: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            check_int(name, getattr(self, name), low=1, allow_numpy=True)

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1) -> RankLayout:
        """The layout of ``world`` ranks with ``tp`` and ``pp`` (DP is what is left).

        >>> RankLayout.for_world(4, tp=2)
        RankLayout(dp=2, tp=2, pp=1)
        """
        check_int("world", world, low=1, allow_numpy=True)
        for name, value in (("tp", tp), ("pp", pp)):
            check_int(name, value, low=1, allow_numpy=True)
        if world % (tp * pp):
            raise InvalidArgument(
                f"{world} ranks do not split into tp={tp} x pp={pp} model-parallel groups; "
                "make the world size a multiple of tp x pp"
            )
        return cls(dp=world // (tp * pp), tp=tp, pp=pp)

    @property
    def world(self) -> int:
        """Ranks in the group: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def leader(self, dp_rank: int) -> int:
        """The rank that writes back for DP rank ``dp_rank`` (TP = PP = 0)."""
        return dp_rank * self.tp

    def leaders(self) -> list[int]:
        """Every DP rank's leader, in DP order."""
        return [self.leader(d) for d in range(self.dp)]

    def to_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankLayout:
        return cls(dp=int(data["dp"]), tp=int(data.get("tp", 1)), pp=int(data.get("pp", 1)))
