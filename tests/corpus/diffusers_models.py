"""diffusers models at small random configs, trained as their fine-tuning scripts train them.

A VAE (AutoencoderKL) trained on reconstruction: encode, sample the latent distribution (its
reparameterization draws with torch.randn), decode, a mean-squared error plus a small KL term.
A diffusion transformer (SD3's MMDiT) trained on a flow-matching target: the noised latents, the
text encoders' hidden states and pooled projection, a timestep, a mean-squared error against the
target velocity.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .case import Case, Normal, Uniform

LIBRARY = "diffusers"
BATCH = 2


class VAETraining(nn.Module):
    def __init__(self, vae: nn.Module, kl_weight: float = 1e-6):
        super().__init__()
        self.vae, self.kl_weight = vae, kl_weight

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        posterior = self.vae.encode(images).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        return F.mse_loss(reconstruction, images) + self.kl_weight * posterior.kl().mean()


def vae():
    from diffusers import AutoencoderKL
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
                          norm_num_groups=32, sample_size=32)
    return Case(VAETraining(model), (torch.randn(BATCH, 3, 32, 32),), kinds={0: Normal()})


class FlowMatching(nn.Module):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, latents, encoder_hidden_states, pooled_projections, timestep, target) -> torch.Tensor:
        out = self.transformer(hidden_states=latents, encoder_hidden_states=encoder_hidden_states,
                               pooled_projections=pooled_projections, timestep=timestep).sample
        return F.mse_loss(out.float(), target.float())


def sd3_transformer():
    from diffusers import SD3Transformer2DModel
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    args = (torch.randn(BATCH, 4, 16, 16), torch.randn(BATCH, 8, 32), torch.randn(BATCH, 16),
            torch.rand(BATCH) * 1000, torch.randn(BATCH, 4, 16, 16))
    return Case(FlowMatching(model), args, kinds={0: Normal(), 1: Normal(), 2: Normal(), 3: Uniform(1000.0),
                                                  4: Normal()})


BUILDERS = {f"diffusers_{f.__name__}": f for f in (vae, sd3_transformer)}
