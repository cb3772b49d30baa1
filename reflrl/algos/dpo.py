"""DPO (Rafailov et al. 2023), Tool-ReRL's DPO baseline (sec. 4.1): preference pairs of a repaired
trajectory (chosen) and the failure it repaired (rejected), both under the original prompt."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(chosen_lp: torch.Tensor, rejected_lp: torch.Tensor, chosen_ref: torch.Tensor,
             rejected_ref: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``-log sigmoid(beta [(c - c_ref) - (r - r_ref)])``, mean over pairs. Inputs are [P] sequence
    log-probs (policy: chosen, rejected; frozen reference: chosen, rejected). Returns (loss, metrics)."""
    margin = beta * ((chosen_lp - chosen_ref.detach()) - (rejected_lp - rejected_ref.detach()))
    loss = -F.logsigmoid(margin).mean()
    return loss, {"dpo/loss": float(loss.detach()), "dpo/margin_mean": float(margin.detach().mean()),
                  "dpo/accuracy": float((margin.detach() > 0).float().mean()), "dpo/pairs": float(len(margin))}
