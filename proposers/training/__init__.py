"""`speculant train-head`: self-distilled EAGLE / MTP / Medusa draft heads (needs the `train` extra: torch).

Serving never imports this package; the proposers read the exported files with NumPy.
"""
