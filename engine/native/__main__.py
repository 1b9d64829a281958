from engine.native import main

main()
