// Speculative sampling's acceptance rule (Leviathan et al. 2023, Chen et al. 2023): a draft token d
// drawn from the drafter's distribution q is kept with probability min(1, p(d) / q(d)) under the
// target's distribution p, and on rejection the token is drawn from the residual
// norm(max(0, p - q)). Whatever q is, the token that comes out is distributed exactly as p.
//
// For a deterministic drafter (n-gram lookup) q is one-hot at d: the rule keeps d with probability
// p(d) and otherwise draws from p without d, which is the same as drawing x ~ p and keeping d iff
// x == d. The engine verifies n-gram drafts that way, with the sequence's own sampler, so a seeded
// request gives the same tokens with and without speculation.
#pragma once

#include <cstdint>
#include <span>

namespace kvflow {

struct DraftVerdict {
  bool accepted = false;
  int32_t token = -1;  // the draft when accepted, else the residual draw
};

// p and q: probabilities over the vocabulary (each summing to 1); q empty means one-hot at `draft`.
// u_accept and u_resample: independent uniforms in [0, 1).
DraftVerdict VerifyDraft(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                         double u_resample);

}  // namespace kvflow
