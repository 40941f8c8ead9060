"""Bridges between fp4rl and the tools its users already run. Each module imports its tool
only when it is imported itself, so fp4rl never requires them."""
