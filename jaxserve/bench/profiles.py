"""Production-shaped workloads: ``--dataset-name chat-like``, ``code-like`` and
``mixed-system-prompt``, with lengths and arrival burstiness taken from a public production trace.

Source: the Azure LLM inference trace 2023 (Patel et al., "Splitwise: Efficient generative LLM
inference using phase splitting", ISCA 2024), https://github.com/Azure/AzurePublicDataset
(``AzureLLMInferenceDataset2023.md``; data ``data/AzureLLMInferenceTrace_conv.csv``, 19,366
requests, and ``data/AzureLLMInferenceTrace_code.csv``, 8,819 requests, both at commit
7909210; one hour of 2023-11-16). The paper plots these lengths as CDFs (Fig. 3); the medians
in its text could not be checked here, so every figure below was computed from the two
published CSV files (``numpy.percentile``; tokens are the trace's ``ContextTokens`` and
``GeneratedTokens``):

  trace         prompt median / p90   output median / p90   inter-arrival gaps: CV, 1/CV^2
  conversation  1020 / 2734.5         129 / 424             1.09, 0.84
  code          1469 / 5187.6         13 / 55               2.21, 0.20 (gaps <= 5 s)

Lengths: independent lognormals (the trace's log prompt and log output lengths are almost
uncorrelated: 0.09 and -0.005) with the trace's median and 90th percentile (``sigma =
ln(p90 / median) / z_0.9``), rounded, at least 1, and kept only where prompt + output <=
``max_len`` (``--profile-max-len``, default 2048, so a model with a 2048-token context serves every
request), by rejection, as vLLM's ShareGPT filter does. The bound trims the long tail and moves
the kept medians down (``BOUNDED_MEDIANS``); ``max_len`` >= 8192 keeps > 95% of the draws.

Arrivals: the default ``--burstiness`` (gamma shape, arrivals.py) of a profile is ``1 / CV^2`` of
the trace's gaps. The conversation trace is near-Poisson (0.84). The code trace is bursty at two
scales: within active periods (gaps <= 5 s) 0.20; over the whole hour, with 45 idle gaps of 10-217
s, 0.006, which no renewal process with a finite run length reproduces usefully, so 0.20 is used.
BurstGPT (Wang et al. 2024, https://arxiv.org/abs/2401.17644) also models arrivals as gamma
processes burstier than Poisson; its fitted shapes could not be checked here and are not used.

``mixed-system-prompt``: one shared system prompt (``--profile-system-prompt-len`` tokens, default
256, the first tokens of the corpus, identical in every request) in front of a chat-like user turn;
the user turn and output are bounded by ``max_len - system_prompt_len``.

Prompt text is cut from ``TextCorpus`` (public-domain prose, also for ``code-like``): the Azure
dataset's own description notes that prompt content does not change the performance metrics, only
the sizes do; shared prefixes (the mixed profile) are the exception, and are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxserve.bench.datasets import SampleRequest, TextCorpus

_Z90 = 1.2815515655446004  # the standard normal's 90th percentile
DEFAULT_MAX_LEN = 2048
DEFAULT_SYSTEM_PROMPT_LEN = 256
_MIN_ACCEPT = 0.01  # a bound keeping fewer draws than this is refused


@dataclass(frozen=True)
class LengthFit:
    """A lognormal length distribution (tokens) given by a trace's median and 90th percentile."""

    median: float
    p90: float

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / _Z90

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``int64[n]`` lengths, rounded, at least 1."""
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.maximum(np.rint(x), 1).astype(np.int64)


@dataclass(frozen=True)
class Profile:
    """A production-shaped workload: prompt and output length distributions (tokens) fitted
    to a public trace's median and p90 (module docstring gives the sources), the default
    gamma shape of its arrivals, and whether a shared system prompt precedes each turn."""

    prompt: LengthFit  # the user turn's tokens (the system prompt excluded)
    output: LengthFit
    burstiness: float  # default gamma shape of the inter-arrival gaps
    shared_system_prompt: bool = False


_CONVERSATION = (LengthFit(1020, 2734.5), LengthFit(129, 424))
PROFILES: dict[str, Profile] = {
    "chat-like": Profile(*_CONVERSATION, burstiness=0.84),
    "code-like": Profile(LengthFit(1469, 5187.6), LengthFit(13, 55), burstiness=0.20),
    "mixed-system-prompt": Profile(*_CONVERSATION, burstiness=0.84, shared_system_prompt=True),
}

# Medians of the kept (prompt, output) draws at the defaults (2048; the mixed profile's user turn:
# 2048 - 256), from 400,000 seeded draws; tests/bench/test_profiles.py checks them.
BOUNDED_MEDIANS = {"chat-like": (821, 123), "code-like": (912, 13),
                   "mixed-system-prompt": (772, 121)}


def default_burstiness(dataset_name: str) -> float:
    """The profile's gamma shape for ``--burstiness`` when the flag is absent; 1.0 (Poisson) for
    every other workload."""
    p = PROFILES.get(dataset_name)
    return p.burstiness if p else 1.0


def profile_lengths(profile: Profile, n: int, rng: np.random.Generator, max_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) lengths (``int64[n]`` each, tokens) with prompt + output <=
    ``max_len``, by rejection.

    Raises:
      ValueError: ``max_len`` so small that fewer than 1% of the draws fit.
    """
    probe = 4096
    i, o = profile.prompt.draw(rng, probe), profile.output.draw(rng, probe)
    ok = i + o <= max_len
    accept = ok.mean()
    if accept < _MIN_ACCEPT:
        raise ValueError(f"--profile-max-len leaves {max_len} tokens for prompt + output, which "
                         f"keeps {accept:.2%} of the profile's lengths; raise it (>= 512)")
    ins, outs, got = [i[ok]], [o[ok]], int(ok.sum())
    while got < n:
        m = int((n - got) / accept * 1.2) + 16
        i, o = profile.prompt.draw(rng, m), profile.output.draw(rng, m)
        ok = i + o <= max_len
        ins.append(i[ok])
        outs.append(o[ok])
        got += int(ok.sum())
    return np.concatenate(ins)[:n], np.concatenate(outs)[:n]


def profile_dataset(
    name: str,
    num_prompts: int,
    seed: int,
    chat: bool,
    corpus: TextCorpus,
    max_len: int = DEFAULT_MAX_LEN,
    system_prompt_len: int = DEFAULT_SYSTEM_PROMPT_LEN,
) -> list[SampleRequest]:
    """``num_prompts`` requests of profile ``name`` (module doc): token ids (completions) or text
    (chat) cut from ``corpus``; ``prompt_len`` counts the shared system prompt where there is one.

    Raises:
      ValueError: unknown profile, or bounds that leave no room (naming the flag).
    """
    if name not in PROFILES:
        raise ValueError(f"--dataset-name profile must be one of {tuple(PROFILES)}, got {name!r}")
    profile = PROFILES[name]
    system_len = system_prompt_len if profile.shared_system_prompt else 0
    if system_len < 0 or (profile.shared_system_prompt and system_len < 1):
        raise ValueError(f"--profile-system-prompt-len must be >= 1, got {system_prompt_len}")
    if max_len - system_len < 2:
        raise ValueError(f"--profile-max-len {max_len} leaves no room after the "
                         f"{system_len}-token system prompt")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = profile_lengths(profile, num_prompts, rng, max_len - system_len)
    system_ids = np.take(corpus.ids, np.arange(system_len), mode="wrap").tolist()
    system_text = corpus.tokenizer.decode(system_ids) if chat and system_len else ""
    out: list[SampleRequest] = []
    for n, m in zip(in_lens.tolist(), out_lens.tolist()):
        ids = corpus.window(rng, n)
        prompt: list[int] | str = system_ids + ids
        if chat:
            turn = corpus.tokenizer.decode(ids)
            prompt = f"{system_text}\n\n{turn}" if system_len else turn
        out.append(SampleRequest(prompt, system_len + n, m))
    return out
