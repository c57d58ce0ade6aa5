"""The training loop (:mod:`.trainer`) and its state objects (:mod:`.state`)."""
