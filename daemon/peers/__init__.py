"""The peer tier: each committed part copied to other nodes of its job, and read back from them after a node is lost."""
