# The engine's interface to the rest of the package (the spin model's saddle point, layers and
# models that report solver results); not re-exported by `energyattn` itself.
from ._adjoint import (
    AbstractAdjoint as AbstractAdjoint,
    ImplicitAdjoint as ImplicitAdjoint,
    PhantomAdjoint as PhantomAdjoint,
    UnrolledAdjoint as UnrolledAdjoint,
    implicit_value as implicit_value,
)
from ._anderson import Anderson as Anderson
from ._descend import descend as descend
from ._fixed_point import fixed_point as fixed_point
from ._fixed_point_solver import AbstractFixedPointSolver as AbstractFixedPointSolver
from ._iterate import (
    AbstractIterativeSolver as AbstractIterativeSolver,
    AbstractObjective as AbstractObjective,
    AbstractProblem as AbstractProblem,
    FixedPointProblem as FixedPointProblem,
    MinimiseProblem as MinimiseProblem,
    RootProblem as RootProblem,
    bounded_while as bounded_while,
    flatten_problem as flatten_problem,
    iterate as iterate,
    no_grad as no_grad,
    ok_result as ok_result,
)
from ._lbfgs import LBFGS as LBFGS
from ._linear import (
    CG as CG,
    GMRES as GMRES,
    LU as LU,
    AbstractLinearSolver as AbstractLinearSolver,
    AutoLinearSolver as AutoLinearSolver,
    Cholesky as Cholesky,
)
from ._local import local_forces as local_forces
from ._minimise import minimise as minimise
from ._newton import Newton as Newton
from ._picard import Picard as Picard
from ._root_find import root_find as root_find
from ._search import Trial as Trial
from ._sign import sign_descend as sign_descend
from ._solution import RESULTS as RESULTS, Solution as Solution
from ._solve import DEFAULT_MAX_STEPS as DEFAULT_MAX_STEPS
