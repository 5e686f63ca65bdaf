"""Hugging Face ``transformers.Trainer`` callback for ckptstage (being written)."""
