"""Tool-ReRL's variants (Table 1, Table 2), by name: what each does in the CPU trainer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reflrl.registry import Registry

if TYPE_CHECKING:
    from reflrl.config import Config


@dataclass(frozen=True)
class Variant:
    """What a variant does (module doc table).

    reflect: failed trajectories are repaired; source: "critic" | "self" | "external";
    importance: repaired rows get eq. 2's weight (the ``tool_rerl`` loss); think: default of
    ``reflection.think``; dpo: train with DPO on (repair, failure) pairs; cpu_error: why the CPU
    trainer cannot run it (None: it can).
    """

    name: str
    reflect: bool = False
    source: str = "critic"
    importance: bool = False
    think: bool = False
    dpo: bool = False
    cpu_error: str | None = None


VARIANTS: Registry[Variant] = Registry("reflection variant")
for _v in (
    Variant("grpo"),
    Variant("ppo"),  # PPO: a value head and GAE (algo.advantage=gae, Tool-ReRL appendix A.2; reflrl.train.extras)
    Variant("cot", think=True),
    Variant("ref", reflect=True, source="critic"),
    Variant("cot_is", reflect=True, source="self", importance=True, think=True),
    Variant("external", reflect=True, source="external"),
    Variant("external_is", reflect=True, source="external", importance=True),
    Variant("tool_rerl", reflect=True, source="critic", importance=True),
    Variant("dpo", reflect=True, source="critic", dpo=True),
):
    VARIANTS.register(_v.name, _v)


def variant_of(cfg: Config) -> Variant:
    return VARIANTS.get(cfg.reflection.variant)


def think_of(cfg: Config) -> bool:
    """Whether prompts ask for a <think> block: ``reflection.think``, else the variant's default."""
    t = cfg.reflection.think
    return variant_of(cfg).think if t is None else bool(t)
