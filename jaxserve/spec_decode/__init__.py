"""Speculative decoding on the host (numpy, no jax): proposers that guess the next tokens of a
request from its own tokens. The target model verifies the guesses in the ordinary step
(`jaxserve.sample.rejection`)."""

from jaxserve.spec_decode.ngram import propose_ngram
from jaxserve.spec_decode.proposer import Proposer, make_proposer
from jaxserve.spec_decode.suffix import SuffixProposer

__all__ = ["Proposer", "SuffixProposer", "make_proposer", "propose_ngram"]
