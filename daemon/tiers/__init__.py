"""Where checkpoints are stored: the tier interface, its file-system and object-store kinds, and the probe of their room."""
