"""Planning: a model, a config and a budget become a printable `OffloadPlan` of placements. Pure: nothing here moves
a tensor, touches CUDA streams or changes the model (the link's speed is measured, once, by `link_speed`)."""
