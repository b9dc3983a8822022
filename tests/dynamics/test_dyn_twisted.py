"""The twisted-Wasserstein structure of SoftMax attention (docs/theory.md §16.5, Castin et al. §5.4)."""

import pytest
import torch
from dyn_helpers import D64, gen, rel

from sinkformer.dynamics import energies as E
from sinkformer.dynamics import simulate, tangent, velocity
from sinkformer.dynamics.velocity import on_sphere


def structured_params(g, d=3, scale=0.05):
    """A symmetric indefinite A and V = B A with B symmetric positive definite."""
    M = torch.randn(d, d, dtype=D64, generator=g)
    A = scale * (M + M.T)
    R = torch.randn(d, d, dtype=D64, generator=g)
    B = R @ R.T / d + 0.3 * torch.eye(d, dtype=D64)
    return A, B, B @ A


def grad_f0(x, A):
    x = x.clone().requires_grad_(True)
    E.f0(x, A).backward()
    return x.grad


def test_softmax_field_is_the_twisted_gradient_of_f0():
    """dF0/dx_i = (Z_i / N) B^{-1} Gamma(x_i): the SoftMax flow is the F0-ascent for the mobility B / Z."""
    g = gen(31)
    A, B, V = structured_params(g, scale=0.3)
    x = torch.randn(25, 3, dtype=D64, generator=g)
    eye = torch.eye(3, dtype=D64)
    field = velocity(x, (A, eye, V), "softmax")
    Z = (x @ A @ x.T).exp().mean(1, keepdim=True)
    assert rel(grad_f0(x, A), Z / 25 * torch.linalg.solve(B, field.T).T) < 1e-13
    # USA (the unnormalised kernel) is the plain gradient: no Z
    usa = velocity(x, (A, eye, V), "exp")
    assert rel(grad_f0(x, A), torch.linalg.solve(B, usa.T).T / 25) < 1e-13
    # and the mobility matters: B alone (Wasserstein) does not give the SoftMax field
    assert rel(grad_f0(x, A), torch.linalg.solve(B, field.T).T / 25) > 0.1


def test_on_the_sphere_the_tangent_field_is_the_riemannian_twisted_gradient():
    """Q = K = V = I at inverse temperature beta: P^perp grad F0 = (Z_i / N) beta Gamma^sphere(x_i)."""
    g = gen(32)
    beta = 3.0
    x = on_sphere(torch.randn(20, 4, dtype=D64, generator=g))
    eye = torch.eye(4, dtype=D64)
    field = velocity(x, (eye, eye, eye), "softmax", eps=1 / beta, geometry="sphere")
    Z = (beta * x @ x.T).exp().mean(1, keepdim=True)
    riemannian = tangent(x, grad_f0(x, beta * eye))
    assert rel(riemannian, Z / 20 * beta * field) < 1e-13


def _energy_increment_error(steps, geometry="euclidean"):
    g = gen(33)
    if geometry == "sphere":
        A = 2.0 * torch.eye(3, dtype=D64)
        V = torch.eye(3, dtype=D64)
        x0 = on_sphere(torch.randn(20, 3, dtype=D64, generator=g))
    else:
        A, _, V = structured_params(g)  # small enough that nothing blows up by t = 1 (Castin et al. Prop. 2)
        x0 = torch.randn(30, 3, dtype=D64, generator=g)
    eye = torch.eye(3, dtype=D64)
    traj = simulate(x0, (A, eye, V), t1=1.0, steps=steps, method="rk4", geometry=geometry,
                    energy=lambda z: E.f0(z, A))
    rates = torch.stack([E.twisted_dissipation(p, A, V, geometry=geometry) for p in traj.positions])
    h = 1.0 / steps  # Simpson's rule on the recorded rates
    integral = (h / 3) * (rates[0] + rates[-1] + 4 * rates[1:-1:2].sum() + 2 * rates[2:-1:2].sum())
    increment = traj.energies[-1] - traj.energies[0]
    return float((increment - integral).abs() / increment.abs()), float(increment)


@pytest.mark.parametrize("geometry", ["euclidean", "sphere"])
def test_f0_grows_at_the_twisted_dissipation_rate(geometry):
    """F0(t) - F0(0) = int_0^t ||Gamma||^2_{tw} ds, to the order-4 error of RK4 + Simpson."""
    errors = [_energy_increment_error(steps, geometry)[0] for steps in (20, 40)]
    increment = _energy_increment_error(40, geometry)[1]
    assert increment > 1e-3  # the energy changed
    assert errors[1] < 1e-8 * (1 if geometry == "euclidean" else 100)
    assert 10 < errors[0] / errors[1] < 24  # fourth order: halving h divides the error by ~16


def test_twisted_structure_refuses_parameters_outside_its_assumptions():
    A = torch.tensor([[1.0, 0.5], [0.0, 1.0]], dtype=D64)
    with pytest.raises(ValueError, match="symmetric A"):
        E.twisted_mobility(A, A)
    A = torch.eye(2, dtype=D64)
    with pytest.raises(ValueError, match="B symmetric positive definite"):
        E.twisted_mobility(A, -A)
    x = torch.randn(5, 2, dtype=D64)
    with pytest.raises(ValueError, match="multiple of I"):
        E.twisted_dissipation(x, A, torch.diag(torch.tensor([1.0, 2.0], dtype=D64)), geometry="sphere")
