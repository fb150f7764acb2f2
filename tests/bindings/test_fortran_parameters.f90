! The Fortran module's parameter doors on a deck's layer: shapes, get and set
! of a routed expert by global id (the owner's copies written, the other
! ranks passing an empty array), the router weight, refused arguments (the
! same error on every rank, nothing written), and the gradients of a
! backward, the same on every rank. Prints "test_fortran_parameters: ok".
!
!   mpiexec -n 2 test_fortran_parameters inputs/quickstart.toml
program test_fortran_parameters
  use mpi
  use kokkosmoe
  use, intrinsic :: iso_c_binding
  implicit none
  type(kmoe_layer) :: layer
  real(c_float), allocatable :: hidden(:, :), out(:, :), dx(:, :), down(:, :), down2(:, :), router(:, :), grad(:, :), empty(:, :)
  integer(c_int32_t), allocatable :: local(:)
  integer(c_int64_t) :: d, tokens, elements
  integer(c_int32_t) :: experts, top_k
  integer(c_int) :: dtype, st
  character(len=4096) :: deck
  integer :: rank, size, ierr, count, e, ffn
  real(c_float) :: keep
  double precision :: lo, hi, gsum
  logical :: owner

  call get_command_argument(1, deck)
  call check(kmoe_initialize(), 'kmoe_initialize')
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, size, ierr)
  call check(kmoe_layer_create_from_deck(layer, deck, MPI_COMM_WORLD), 'create')
  call check(kmoe_layer_shape(layer, d, experts, top_k, dtype, tokens), 'shape')

  ! expert_down of expert e is the C tensor [d][ffn]: the Fortran array (ffn, d).
  call check(kmoe_layer_parameter_count(layer, kmoe_expert_down, count, elements), 'parameter_count')
  call expect(count == experts, 'one expert_down tensor per expert')
  ffn = int(elements / d)
  allocate (down(ffn, d), down2(ffn, d), empty(0, 0), router(d, experts), grad(d, experts))
  call check(kmoe_layer_local_experts(layer, local), 'local_experts')
  e = experts - 1
  owner = any(local == e)
  call check(kmoe_layer_get_parameter(layer, kmoe_expert_down, e, down), 'get expert_down')
  down = 2.0 * down
  if (owner) then
    call check(kmoe_layer_set_parameter(layer, kmoe_expert_down, e, down), 'set expert_down (owner)')
  else
    call check(kmoe_layer_set_parameter(layer, kmoe_expert_down, e, empty), 'set expert_down (no copy)')
  end if
  call check(kmoe_layer_get_parameter(layer, kmoe_expert_down, e, down2), 'get expert_down again')
  call expect(all(down2 == down), 'set then get: the same values on every rank')

  ! Refused: a wrong size, and a non-finite value on one rank; nothing written.
  st = kmoe_layer_get_parameter(layer, kmoe_expert_down, e, router)
  call expect(st == kmoe_error_invalid_argument .and. index(kmoe_last_error(), 'count is') > 0, 'a wrong-size array is refused')
  call check(kmoe_layer_get_parameter(layer, kmoe_router_weight, 0, router), 'get router_weight')
  keep = router(2, 1)
  if (rank == 0) router(2, 1) = ieee_nan()
  st = kmoe_layer_set_parameter(layer, kmoe_router_weight, 0, router)
  call expect(st == kmoe_error_invalid_argument .and. index(kmoe_last_error(), 'value 1 is nan') > 0, &
              'a NaN on rank 0 is refused on every rank')
  call check(kmoe_layer_get_parameter(layer, kmoe_router_weight, 0, router), 'get router_weight again')
  call expect(router(2, 1) == keep, 'a refused set changes nothing')

  ! A backward, then the router weight's gradient: the same on every rank.
  allocate (hidden(d, tokens), out(d, tokens), dx(d, tokens))
  call check(kmoe_layer_deck_rows(layer, 0, hidden), 'deck_rows')
  call check(kmoe_layer_forward(layer, hidden, out), 'forward')
  call check(kmoe_layer_backward(layer, hidden, out, dx), 'backward')
  call check(kmoe_layer_get_gradient(layer, kmoe_router_weight, 0, grad), 'get_gradient router_weight')
  gsum = sum(dble(grad)**2)
  lo = gsum
  hi = gsum
  call MPI_Allreduce(MPI_IN_PLACE, lo, 1, MPI_DOUBLE_PRECISION, MPI_MIN, MPI_COMM_WORLD, ierr)
  call MPI_Allreduce(MPI_IN_PLACE, hi, 1, MPI_DOUBLE_PRECISION, MPI_MAX, MPI_COMM_WORLD, ierr)
  call expect(gsum > 0 .and. lo == hi, 'a router gradient, the same on every rank')
  call check(kmoe_layer_get_gradient(layer, kmoe_expert_down, e, down2), 'get_gradient expert_down')
  call expect(all(down2 == down2), 'a finite expert gradient')

  call check(kmoe_layer_destroy(layer), 'destroy')
  call check(kmoe_finalize(), 'finalize')
  if (rank == 0) print '(a)', 'test_fortran_parameters: ok'

contains

  real(c_float) function ieee_nan()
    use, intrinsic :: ieee_arithmetic
    ieee_nan = ieee_value(0.0_c_float, ieee_quiet_nan)
  end function

  subroutine check(status, what)
    integer(c_int), intent(in) :: status
    character(len=*), intent(in) :: what
    if (status /= kmoe_success) then
      print '(a,a,i0,a,a)', what, ' FAILED with status ', status, ': ', kmoe_last_error()
      error stop 1
    end if
  end subroutine

  subroutine expect(ok, what)
    logical, intent(in) :: ok
    character(len=*), intent(in) :: what
    if (.not. ok) then
      print '(a,i0,a,a,a,a)', 'rank ', rank, ': FAILED ', what, ': ', kmoe_last_error()
      error stop 1
    end if
  end subroutine

end program test_fortran_parameters
