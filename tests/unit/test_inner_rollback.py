"""mpiopt.torch.survival.InnerRollback: an inner optimizer's state put back as it was before its last step."""

import pytest

torch = pytest.importorskip("torch")

from mpiopt.torch.survival import InnerRollback  # noqa: E402


def model_and_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def one_step(model, opt, seed):
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()


def snapshot(opt):
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for i, p in enumerate(q for g in opt.param_groups for q in g["params"]) if p in opt.state}


def test_restore_undoes_the_step_after_the_save_bitwise_and_the_redo_is_the_unbroken_step():
    model, opt = model_and_adamw()
    twin, twin_opt = model_and_adamw()
    rollback = InnerRollback()
    for seed in (1, 2):
        one_step(model, opt, seed)
        one_step(twin, twin_opt, seed)
    before, tensors = snapshot(opt), {id(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    rollback.save(opt, step=3)
    with torch.no_grad():
        kept_params = [p.clone() for p in model.parameters()]
    one_step(model, opt, 3)  # the step a lost rank breaks: its parameters are put back by the algorithm
    with torch.no_grad():
        for p, kept in zip(model.parameters(), kept_params):
            p.copy_(kept)
    rollback.restore(opt)
    after = snapshot(opt)
    assert after.keys() == before.keys() and rollback.step == 3
    for i in before:
        for name, value in before[i].items():
            assert torch.equal(after[i][name], value), (i, name)
    # in place: the optimizer's own tensors are still the ones it had
    assert {id(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)} == tensors
    one_step(model, opt, 3)  # redone, it is the unbroken run's step
    one_step(twin, twin_opt, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert float(opt.state[next(model.parameters())]["step"]) == 3.0


def test_a_failed_first_step_leaves_no_state():
    model, opt = model_and_adamw()
    rollback = InnerRollback()
    rollback.save(opt, step=1)
    one_step(model, opt, 1)
    assert len(opt.state) == 4
    rollback.restore(opt)
    assert len(opt.state) == 0
