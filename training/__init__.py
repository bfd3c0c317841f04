"""Distributed training of the reference transformer (no control plane: see DESIGN.md section 2.4)."""
