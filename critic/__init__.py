"""Frozen critics that score a failed attempt and write a reflection (Tool-ReRL, appendix C).

Built by the Tool-ReRL issue; the package exists so ``reflrl.critic`` imports today.
"""
