"""The bounded DPPO activation diagnostic: the requester's revised plan, run as written.

Restore the shared initial state, sample ONE batch, freeze it, then train the DPPO arm on
complete-group minibatches for two epochs over that same batch (at most 16 updates, no new
sampling, no old-logprob refresh), recording every loss call and fixed sentinel tokens. Stop at
the update cap or the wall cap, whichever comes first. Then pool all second-epoch loss calls by
loss-token counts, evaluate the plan's criteria, and classify the outcome.

Parts: `config` (the plan's settings), `loop` (the run and what it measured), `classification`
(the plan's criteria, the must-fire / must-not-fire self-test, the verdict for the planned model and
the next action), and `write` (the analysis and the one evidence writer: every file name and
result.json field the diagnostic sets, the summary among them).
"""
