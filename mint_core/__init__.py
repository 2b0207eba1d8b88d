"""mint: train and serve many LoRA policies over one resident base model."""

__version__ = "0.1.0"
