"""What is learned: the synthetic tasks, their tokenizer, prompts, reward functions, datasets
and prompt sources.

Imports ``core`` only.
"""
