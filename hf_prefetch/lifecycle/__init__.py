"""Changing a model and undoing it: the checks every verb makes first, the state a dispatch leaves on the model, the
journal of every change with its undo, the steps that execute a plan on a model (`attach`) and take it off again
(`detach`), compressed host storage, the forward gate, the state-dict write-through and the refusals a dispatched
model carries."""
