"""Input formats in, one canonical evaluation record out (parsing and derivation)."""
