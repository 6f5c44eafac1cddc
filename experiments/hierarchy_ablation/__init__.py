"""The hierarchy ablation: does training the sub-agent (M-GRPO) beat the alternatives?"""
