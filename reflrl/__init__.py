"""reflrl: reinforcement learning for LLM tool calling, through misbehaving tools."""

__version__ = "0.1.0"
