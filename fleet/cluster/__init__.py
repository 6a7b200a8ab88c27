"""The cluster door: what the control plane needs of Ray, and the one module that touches Ray."""
