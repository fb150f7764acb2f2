! A Fortran program built against the installed module through pkg-config only:
!   mpifort fortran_consumer.f90 $(pkg-config --cflags --libs kokkosmoe-fortran)
! The version and build, an EPLB placement, a deck layer's forward.
program fortran_consumer
  use mpi
  use kokkosmoe
  use, intrinsic :: iso_c_binding
  implicit none
  type(kmoe_layer) :: layer
  type(kmoe_step_summary) :: step
  real(c_float), allocatable :: hidden(:, :), out(:, :)
  real(c_double) :: loads(4) = [8d0, 1d0, 1d0, 2d0]
  integer(c_int32_t) :: slot_expert(8), slot_rank(8)
  integer(c_int64_t) :: d, tokens
  integer(c_int32_t) :: experts, top_k
  integer(c_int) :: dtype
  character(len=4096) :: deck
  integer :: rank, ierr

  call get_command_argument(1, deck)
  call check(kmoe_initialize())
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  if (index(kmoe_build_configuration(), '"version":"' // kmoe_version() // '"') == 0) error stop 'build configuration'
  call check(kmoe_eplb(loads, 2, 1, 1, slot_expert, slot_rank))
  if (count(slot_expert == 0) < 2) error stop 'the hot expert is not replicated'
  call check(kmoe_layer_create_from_deck(layer, deck, MPI_COMM_WORLD))
  call check(kmoe_layer_shape(layer, d, experts, top_k, dtype, tokens))
  allocate(hidden(d, tokens), out(d, tokens))
  call check(kmoe_layer_deck_rows(layer, 0, hidden))
  call check(kmoe_layer_forward(layer, hidden, out))
  call check(kmoe_layer_last_step(layer, step))
  if (step%tokens /= tokens .or. step%routes_attempted /= tokens * top_k) error stop 'step summary'
  call check(kmoe_layer_destroy(layer))
  deallocate(hidden, out)
  if (rank == 0) print '(a,a)', 'fortran consumer ok: KokkosMoE ', kmoe_version()
  call check(kmoe_finalize())

contains

  subroutine check(st)
    integer(c_int), intent(in) :: st
    if (st /= kmoe_success) then
      print '(a,a)', 'fortran consumer: ', kmoe_last_error()
      error stop 1
    end if
  end subroutine check

end program fortran_consumer
