"""Learned draft heads (EAGLE, MTP, Medusa) that read the target's hidden states."""
