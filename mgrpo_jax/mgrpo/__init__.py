"""M-GRPO (docs/algorithm.md): the task, setup, play and step, and the programs that run them.

  tasks       the deep-research task built from a config (world or QA data, tools, tokenizer)
  setup       the variant as `Wiring`, config and task checks, the agents, and the set-up
              every program does once (`start` -> `Program`, run by `loop.step_driver`)
  play        turn policies, rollouts (`Rollouts`), R_M and held-out evaluation
  step        main side, sub side, batches, update: one step's data flow
  delegation  what the decoupled programs say to each other over the exchange
  colocated, decoupled, sft   the programs (launch/train.py, main_agent.py, sub_agent.py)
"""
