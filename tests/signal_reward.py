"""A reward a random tiny model earns, for the short end-to-end runs: the share of lowercase letters in the
response. About a quarter of the tiny tokenizer's characters are lowercase, so the n samples of a prompt score
differently from the first step, their advantages are not zero, and the policy-gradient term moves the weights
(the built-in task's reward is 0 for every sample of a random model: only the KL and weight decay would). The
same number is returned as `accuracy` too, the key the built-in reward logs and the DAPO preset filters groups on."""


def lowercase(inp):
    response = inp["response"]
    share = sum(c.islower() for c in response) / max(len(response), 1)
    return {"overall": share, "accuracy": share}
