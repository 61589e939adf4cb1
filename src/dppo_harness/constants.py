"""Pinned numbers and revisions shared by every module (see docs/design.md)."""

PPO_EPS = 0.2
DPPO_RATIO_CAP = 10.0  # C of the released-code variant (the paper's text uses 5)
LOG_RATIO_CLAMP_MAX = 20.0

BASE_MODEL = "Qwen/Qwen3.5-2B"
RENDERER_NAME = "qwen3_5"
STOP_TOKEN_ID = 248046  # <|im_end|>

REFERENCE_REVISION = "sail-sg/Stable-RL@c6af1d119c0fe30d16dd9a837d35fdf695acd226:verl/trainer/ppo/core_algos.py"
BASELINE_REVISION = (
    "tinker==0.25.0 ppo loss; tinker-cookbook==0.5.7 rl/train.py, rl/data_processing.py::compute_advantages"
)

# Each comparison arm's state (weights + optimizer) is saved at least every MAX_SAVE_EVERY steps.
MAX_SAVE_EVERY = 10

# Not a secret: the embedded server ignores API keys, but the SDK insists on the tml- prefix.
LOCAL_API_KEY = "tml-local-rehearsal"

# Marker of the embedded server, read before any client exists (launch scope, the evidence's backend block): a response
# header on every answer and `get_server_capabilities()["embedded_server"]`. Which model computed is get_info's model_name.
EMBEDDED_SERVER_HEADER = "X-Embedded-Tinker-Server"
EMBEDDED_SERVER_MARKER = "dppo-harness"
