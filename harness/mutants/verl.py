"""Mutants of a released framework's own code path, killed in that release's env (``tox -e verl-0.9.1``).

Each is the release's subject with one capability's release behaviour undone, to prove that the suite
which passes the release would catch the bug the release fixed. They stay out of the registry
(``harness.mutants.registry``), whose kills run without the release installed;
``tests/test_verl_agent_truncation.py`` proves each kill in the release's env.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from harness.subjects.frameworks.verl import VERL_0_9_1
from harness.subjects.frameworks.verl.truncation import episode
from reference_impl.splice import check_truncation


def unsliced_routes(
    tokens: torch.Tensor, routes: Any, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl 0.9.1's ``ToolAgentLoop`` with its response cut to the budget but its routes not
    (``routed_experts`` as the last engine call returned them: verl #6027 in the agent loop, before
    #6089 sliced them to ``len(prompt_ids) + response_length``)."""
    routes = torch.as_tensor(routes)
    check_truncation(tokens, routes, prompt_len, max_response_len)
    if tokens.shape[0] == prompt_len:
        return tokens, routes
    output, calls = episode("0.9.1", "numpy", tokens, routes, prompt_len, max_response_len)
    kept = torch.tensor(list(output.prompt_ids) + list(output.response_ids), dtype=torch.long)
    return kept, torch.as_tensor(np.asarray(calls[-1].routed_experts))


AGENT_LOOP_UNSLICED_ROUTES = replace(
    VERL_0_9_1, name="mutant:verl-0.9.1-agent-loop-unsliced-routes", truncate=unsliced_routes
)
"""``--rr-subject harness.mutants.verl:AGENT_LOOP_UNSLICED_ROUTES``: killed by
``test_splice.py::test_truncation_cuts_tokens_and_rows_together``."""
