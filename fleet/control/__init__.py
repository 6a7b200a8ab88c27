"""The control plane: ``SingleController`` (one Ray actor) and the parts it is built from."""
