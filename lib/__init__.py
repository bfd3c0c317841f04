"""Code that more than one room uses (the data plane, serving, the control plane, the dev stack)."""
