"""From the trainer's copy to a committed part: sessions, arenas, the persister, manifest checks, the memory tier."""
