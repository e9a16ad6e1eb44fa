"""The readable half of dualattn: the torch oracle (torch_ref) and FA2-style Triton kernels (triton/)."""
