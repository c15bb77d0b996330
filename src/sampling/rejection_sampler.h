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

// How a rejected draft is replaced. Only kResidual is correct; the other two are the known mistakes
// (resampling from the verifier's own distribution, as TriForce's published middle level does, or
// from the drafter's), kept so the distribution tests can show they catch them
// (tests/unit/spec_distribution.h). Production code never selects them.
enum class RejectionRule { kResidual, kResampleFromVerifier, kResampleFromDrafter };

// Where a draft is verified: by the target, or by TriForce's middle level.
enum class VerifySite { kTarget, kMiddle };

// The rule in force at `site`: kResidual unless a mutation test installed another.
RejectionRule ActiveRejectionRule(VerifySite site);

namespace testing {
// Installs `rule` at `site` for its lifetime (process-wide; mutation tests only).
class ScopedRejectionRule {
 public:
  ScopedRejectionRule(VerifySite site, RejectionRule rule);
  ~ScopedRejectionRule();
  ScopedRejectionRule(const ScopedRejectionRule&) = delete;
  ScopedRejectionRule& operator=(const ScopedRejectionRule&) = delete;

 private:
  VerifySite site_;
  RejectionRule previous_;
};
}  // namespace testing

struct DraftVerdict {
  bool accepted = false;
  int32_t token = -1;  // the draft when accepted, else the residual draw
};

// p and q: probabilities over the vocabulary (each summing to 1); q empty means one-hot at `draft`.
// u_accept and u_resample: independent uniforms in [0, 1). A rejection is resampled by the rule in
// force at `site` (always the residual outside mutation tests).
DraftVerdict VerifyDraft(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                         double u_resample, VerifySite site = VerifySite::kTarget);

}  // namespace kvflow
