"""Model building blocks: linear, norm, activation, rotary."""
