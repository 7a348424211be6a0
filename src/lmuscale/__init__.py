"""lmuscale: scaling-law experiments on Legendre Memory Unit language models.

Shape suffixes name a tensor's axes (``x_BxTxD``: batch x positions x width), one meaning each:

  B   batch: independent sequences (or all of a split's examples)
  T   positions, time steps; T1 = T + 1 (a window with its next-token targets)
  D   model width d, a layer's input width; Dp the SRU++ attention width d'
  V   vocabulary
  H   attention heads; A the width of one head, d / H
  O   output units
  C   channels of a memory input (D in the language models)
  Q   memory order q
  K   reduced order q' (a memory kernel's width: Q for the full memory)
  J   chunks; c steps (or positions) per chunk; Z = c + Q, a chunk's inputs and carried state
  F   rFFT frequencies
  M   micro-batches
  R   bootstrap resamples; P a fit's data points; S optimiser starts; U a curve's unknowns;
      W the (s, y) pairs L-BFGS remembers
  1-4 that many (1: a kept singleton axis); 4D, 3K, CQ: one axis of that product
  ``m_xQ``, ``pre_3xxDxK``, ``y_Bx...xO``: an empty slot (or ...) holds any axes

N is never a shape: it is the non-embedding parameter count, as in the papers, whose symbols
the scaling formulas keep (D tokens, S steps, L loss).
"""

import sys

__version__ = "0.1.0"

if sys.argv[:1] == ["-m"]:  # python -m lmuscale.X is starting: a stop signal ends it (outcomes)
    import _signal  # built in: no import between here and the handlers

    _held: list[int] = []  # until outcomes takes the signals
    for _number in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGUSR1, _signal.SIGUSR2):
        if _signal.getsignal(_number) is not _signal.SIG_IGN:  # as Python leaves an ignored one
            _signal.signal(_number, lambda signum, frame: _held.append(signum))
    from lmuscale.outcomes import start_command

    start_command(_held)

# GPT-2's vocabulary size: the models' default and the tokenizer's. It lives here, below both,
# so that the models need not import the data package for one number.
GPT2_VOCAB = 50257
