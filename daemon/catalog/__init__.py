"""What is committed where: the index of parts and steps, commit records, replacements, chunk stores, quarantine."""
