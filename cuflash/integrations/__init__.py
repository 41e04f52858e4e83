"""Integrations of cuflash with other libraries (each imports its library when imported itself)."""
