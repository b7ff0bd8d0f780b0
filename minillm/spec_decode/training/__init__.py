"""Training the drafters (``make drafters``): self-distillation data from the target model
(:mod:`.distill`), the drafters' training loop (:mod:`.train`) and the block drafters'
(:mod:`.block_train`). Serving never imports this package: the trained weights are read by
:mod:`minillm.spec_decode.weights`.
"""
