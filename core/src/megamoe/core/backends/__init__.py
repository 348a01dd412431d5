"""Experts backends: DeepGEMM MegaMoE and the torch reference."""
