"""Each adapter's router load-balancing loss, from the rows it owns in a packed batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_multilora import BatchLayout
from lightning_multilora.router_loss import router_losses


def subclassed(model):
    from transformers import MixtralForCausalLM

    class MyMixtral(MixtralForCausalLM):  # (a class of one's own, in a module without the loss function)
        pass

    model.__class__ = MyMixtral
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("own_class", [False, True])
def test_each_adapter_gets_the_router_loss_of_its_own_rows_as_the_model_gives_them_alone(device, masked, own_class,
                                                                                          tiny_mixtral):
    model = (subclassed(tiny_mixtral()) if own_class else tiny_mixtral()).to(device)
    ids = torch.randint(0, 64, (5, 9), device=device)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # (a padded row: its padding routes nothing)
    mask[4, 3:] = 0
    mask = mask if masked else None
    layout = BatchLayout(("a", "empty", "b"), (0, 2, 2), (2, 2, 5), 5)
    out = model(input_ids=ids, attention_mask=mask)
    got = router_losses(model, out, layout, mask)
    assert got.shape == (3,) and got[1] == 0
    for i, rows in ((0, slice(0, 2)), (2, slice(2, 5))):
        alone = model(input_ids=ids[rows], attention_mask=None if mask is None else mask[rows]).aux_loss
        torch.testing.assert_close(got[i], 0.5 * alone)
    assert not torch.allclose(got[0] / 0.5, out.aux_loss)  # (the batch's is not an adapter's)
    got[0].backward()  # (it trains the layers before the routers)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_no_router_logits_no_router_loss_and_a_loss_that_cannot_be_split_is_said_once(tiny_mixtral):
    layout = BatchLayout(("a",), (0,), (2,), 2)
    ids = torch.randint(0, 64, (2, 5))
    model = tiny_mixtral(output_router_logits=False)
    assert router_losses(model, model(input_ids=ids), layout, None) is None
    model = tiny_mixtral()
    assert router_losses(model, model(input_ids=ids), BatchLayout((), (), (), 2), None) is None  # (no adapter)
    model = tiny_mixtral()
    del model.router_aux_loss_coef  # (a model of another shape: its loss is not the one this splits)
    out = model(input_ids=ids)
    with pytest.warns(UserWarning, match=r"MixtralForCausalLM has no router_aux_loss_coef: the adapters train on their "
                                         r"cross-entropy alone, without its router load-balancing loss"):
        assert router_losses(model, out, layout, None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert router_losses(model, out, layout, None) is None
