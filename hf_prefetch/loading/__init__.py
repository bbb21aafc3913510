"""Loading: safetensors checkpoints read once, straight into host storage and onto the device, then dispatched;
reloading new weights in place. Checkpoint files are untrusted input, validated before a byte is read."""
