from ._adjoint import (
    AbstractAdjoint as AbstractAdjoint,
    ImplicitAdjoint as ImplicitAdjoint,
    PhantomAdjoint as PhantomAdjoint,
    UnrolledAdjoint as UnrolledAdjoint,
)
from ._descend import descend as descend
from ._fixed_point import (
    AbstractFixedPointSolver as AbstractFixedPointSolver,
    Anderson as Anderson,
    Picard as Picard,
    fixed_point as fixed_point,
)
from ._iterate import AbstractIterativeSolver as AbstractIterativeSolver
from ._linear import (
    CG as CG,
    GMRES as GMRES,
    LU as LU,
    AbstractLinearSolver as AbstractLinearSolver,
    AutoLinearSolver as AutoLinearSolver,
    Cholesky as Cholesky,
)
from ._local import local_forces as local_forces
from ._minimise import LBFGS as LBFGS, minimise as minimise
from ._root_find import Newton as Newton, root_find as root_find
from ._sign import sign_descend as sign_descend
from ._solution import RESULTS as RESULTS, Solution as Solution
