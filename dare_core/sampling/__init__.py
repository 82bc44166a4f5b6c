from dare_core.sampling.decode import GenerationOutput, SamplingParams, decode_responses, generate, left_pad

__all__ = ["GenerationOutput", "SamplingParams", "decode_responses", "generate", "left_pad"]
